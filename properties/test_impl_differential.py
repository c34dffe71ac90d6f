"""``impl.BlockManager`` against the spec and the independent model, with bad input, stale and
forged tables and the array API (see :mod:`properties.machines.block_manager`)."""

from properties.machines.block_manager import BlockManagerMachine

TestBlockManagers = BlockManagerMachine.TestCase
