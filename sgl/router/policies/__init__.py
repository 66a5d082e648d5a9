"""Routing policies behind one protocol (`base.Policy`); `make_policy(name, ...)` picks one."""
