from pathlib import Path

from kvtier.config import markdown_table


def test_the_readme_lists_every_configuration_key_as_the_code_defines_it():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert markdown_table() in readme, "README's configuration table is stale: paste `kvtier config --markdown`"
