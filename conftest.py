"""The repository's root conftest: plugins that must see every test folder and the notebooks."""

# nbval's run of each chapter, kept for the book build; where the time went, by file.
pytest_plugins = ["tests.executed_chapters", "tests.time_by_file"]
