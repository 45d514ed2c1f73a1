"""Leaf helpers with no fastvision imports: atomic files, tensor trees."""
