"""kvtier's I/O process: every storage read and write, off the engine's interpreter."""
