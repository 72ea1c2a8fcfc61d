"""Token-tree drafting: shapes and the acceptance model, how a tree grows, the tree-masked
cache, GSD/ERSD verification, and the tree policies."""
