"""Dataset caches: none | ram | disk | shared | smart | gpu, and the selection rule (select.py)."""
