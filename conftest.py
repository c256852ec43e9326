"""The repository's root conftest: plugins that must see every test folder and the notebooks."""

# nbval's run of each chapter, kept for the book build (see the module's docstring).
pytest_plugins = ["tests.executed_chapters"]
