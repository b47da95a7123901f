"""Kernel sources shipped as package data (see DESIGN.md, repository layout)."""
