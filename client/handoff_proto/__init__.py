"""Generated gRPC stubs for the handoff API (see proto/). Do not edit: run `make stubs`."""
