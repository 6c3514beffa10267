"""Adapters to the outside: the gRPC servicer, proto<->domain conversion, the admin HTTP app."""
