"""Tests of the package as a whole: the import graph between layers, the installed wheel, the test lanes themselves."""
