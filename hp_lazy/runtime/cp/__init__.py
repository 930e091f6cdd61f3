"""Context parallel: the sequence of every batch split over the ``cp`` ranks (see :mod:`.style`)."""
