"""The kvd daemon: grpc.aio services on uvloop, thin adapters over ``kvd.core``."""
