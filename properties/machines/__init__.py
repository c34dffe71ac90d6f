"""The state machines the property files run and the planted-bug tests reuse: each is its rules
and its invariant, over the shared driver of :mod:`~properties.machines.lockstep` (the same
call on the model and the implementation, the same outcome). ``vllm.py`` runs in ``.venv-vllm``
only (``properties/vllm_env.py``).
"""
