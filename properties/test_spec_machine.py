"""The block managers and the independent model in lockstep for an honest caller, who never has
a table it does not hold accepted, so every live table's tokens are checked at every step."""

from properties.machines.block_manager import BlockManagerMachine


class HonestCaller(BlockManagerMachine):
    HONEST = True


TestHonestCaller = HonestCaller.TestCase
