"""Developer tools used by the repository's git hooks; not part of the public API."""
