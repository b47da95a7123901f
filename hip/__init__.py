"""Kernel sources shipped as package data (see docs/design.md, "Where things live")."""
