"""Preemption: the elastic-pool controller (DESIGN §3.3, §3.5, §7)."""
