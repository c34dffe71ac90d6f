"""``impl.BlockManager`` against ``spec.BlockManager``, in lockstep: the differential machine of
``properties.machines.differential``, and the spec's own model-based machine
(``properties.machines.block_manager``) run on ``impl``.
"""

from __future__ import annotations

from pagedkv.impl.blocks.manager import BlockManager as ImplBlockManager
from properties.machines.block_manager import block_manager_machine
from properties.machines.differential import DifferentialMachine

TestImplDifferential = DifferentialMachine.TestCase

# The spec's own model-based machine (KV data simulated through every table) on impl as well.
TestSpecMachineOnImpl = block_manager_machine(ImplBlockManager).TestCase
