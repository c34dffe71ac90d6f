"""The state machines the property files run and the planted-bug tests reuse, over the shared
driver of :mod:`~properties.machines.lockstep`; ``vllm.py`` runs in ``.venv-vllm`` only."""
