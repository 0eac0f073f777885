"""Power and energy sources, one module each, behind the ``Sensor`` protocol of ``base``."""
