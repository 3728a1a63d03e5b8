"""tilesparse."""
