"""dtorch-zmq: workers on other hosts (the ``remote`` runner, ``dtorch worker``, ``dtorch keygen``)."""

__version__ = "0.1.0"
