"""Faults planted in stored entries: one byte inverted in place."""


def flip_byte(path, offset: int) -> None:
    """Invert the byte at ``offset`` of the file at ``path``."""
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))
