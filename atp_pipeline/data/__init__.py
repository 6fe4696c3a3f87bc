"""Data shipped with the package: ``corpus.txt``, public-domain English text (Shakespeare's
sonnets of 1609, the Gettysburg Address, and the openings of A Tale of Two Cities, Pride and
Prejudice, Moby-Dick and the Declaration of Independence), read byte by byte."""

from pathlib import Path

CORPUS = Path(__file__).with_name("corpus.txt")
