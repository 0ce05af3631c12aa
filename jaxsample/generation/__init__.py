"""Generation internals; the public names live in ``jaxsample.serve_loop``."""

__all__: list[str] = []
