"""Generated gRPC stubs of proto/rolloutd/v1 (do not edit; run `make proto`)."""
