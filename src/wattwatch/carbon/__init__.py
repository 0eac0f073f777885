"""Grid carbon intensity (``grid``) and how a report applies it (``policy``)."""
