"""handoff: a coordinator for prefill-to-decode KV-cache handoffs."""
