"""Generated from proto/handoff/v1/coordinator.proto by `make stubs`. Do not edit."""
