"""The spec's block manager satisfies every rule, step by step (see block_manager_machine)."""

from pagedkv.spec import BlockManager
from properties.machines.block_manager import block_manager_machine

TestSpecBlockManager = block_manager_machine(BlockManager).TestCase
