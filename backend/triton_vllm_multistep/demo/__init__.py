"""Demo models built locally, deterministically, with no model hub (`models`: `demo://NAME`)."""
