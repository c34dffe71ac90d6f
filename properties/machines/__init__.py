"""The block-management state machines the property files run and the planted-bug tests reuse."""
