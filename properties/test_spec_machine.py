"""The spec's block manager satisfies every rule, step by step (see block_manager_machine)."""

from properties.block_manager_machine import block_manager_machine
from spec import BlockManager

TestSpecBlockManager = block_manager_machine(BlockManager).TestCase
