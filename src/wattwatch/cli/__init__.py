"""The ``wattwatch`` command line: the parser (``main``), one module per command, and ``render/``."""
