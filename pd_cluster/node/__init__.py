"""A node process's plumbing, shared by the prefill and decode roles: its settings (config), the
master connection (agent), start/drain/stop (lifecycle), status reports (status), and the base class
that wires them (runtime)."""
