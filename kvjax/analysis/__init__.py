"""Cost analysis: the blog's closed forms (theory), XLA's compiled costs (hlo_cost, costs),
the jaxpr view (roofline), hardware tables and probes."""
