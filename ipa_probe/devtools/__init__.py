"""Developer tools: the git hooks' notebook stripping, the figures and docs/compatibility.md generators; not
part of the public API."""
