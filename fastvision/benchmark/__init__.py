"""`fastvision benchmark`: train / inference / data throughput of any recipe."""
