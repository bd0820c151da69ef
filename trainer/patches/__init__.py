"""Replacements of third-party internals (torch's FSDP2, diffusers' Qwen-Image transformer).

Each module here swaps one library function for a faster one computing the same values; each
has an ``install`` function, the library versions it was written against (it refuses to
install on any other), and a test against the original it replaces. Nothing outside this
package patches a library."""
