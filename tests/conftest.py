from unified.registry import available_backends

# Every registered backend whose framework is installed: the built-in ones, and any registered
# through the `unified.backends` entry-point group. (The conformance suite in unified/testing is
# parametrized by its pytest plugin instead, which also honours --unified-backend.)
BACKENDS = available_backends()
