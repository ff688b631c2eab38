"""Framework primitives for `unified`: one module per framework, registered in `unified/backend.py`."""
