"""Acceptance heads: the ResNet head (save, load, hub) and the draft statistics it may read."""
