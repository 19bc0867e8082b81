"""Test helpers, one home each: fakes (clock, ports), processes, servers, one module per area."""
