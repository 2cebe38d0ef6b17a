"""Routers: `common` (health, models, tokenize, metrics); protocol routers join later."""
