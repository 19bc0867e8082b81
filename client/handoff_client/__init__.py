"""handoff_client: the SDK for frontends and engine sidecars."""
