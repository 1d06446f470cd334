"""Billing: the append-only usage ledger, credits for forced preemption, statements."""
