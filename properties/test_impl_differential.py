"""``impl.BlockManager``: the differential machine, and the spec's model-based machine on impl."""

from __future__ import annotations

from pagedkv.impl.blocks.manager import BlockManager as ImplBlockManager
from properties.machines.block_manager import block_manager_machine
from properties.machines.differential import DifferentialMachine

TestImplDifferential = DifferentialMachine.TestCase

TestSpecMachineOnImpl = block_manager_machine(ImplBlockManager).TestCase
