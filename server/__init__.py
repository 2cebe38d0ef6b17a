"""HTTP layer: FastAPI app, auth, admission, errors, metrics and SSE helpers over the engine.

The server is thin: validation, recipe, engine call, streaming. Protocol conversion lives in
`recipe/`; the engine in `engine/`.
"""
