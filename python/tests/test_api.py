"""The stubs and docstrings cover what the module exposes."""
import ast
import pathlib
import pydoc

import zinc

STUB = pathlib.Path(zinc.__file__).with_name("__init__.pyi")


def stub_names():
    tree = ast.parse(STUB.read_text())
    top, engine = set(), set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top.add(node.name)
        if isinstance(node, ast.ClassDef) and node.name == "Engine":
            engine = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
        if isinstance(node, ast.AnnAssign):
            top.add(node.target.id)
    return top, engine


def test_stubs_cover_the_public_api():
    top, engine = stub_names()
    assert set(zinc.__all__) <= top
    public = {n for n in dir(zinc.Engine) if not n.startswith("_")}
    assert public <= engine, public - engine


def test_help_documents_every_engine_member():
    text = pydoc.render_doc(zinc.Engine, renderer=pydoc.plaintext)
    assert "zinc.initialize(config)" in text
    for name in (n for n in dir(zinc.Engine) if not n.startswith("_")):
        doc = getattr(zinc.Engine, name).__doc__
        assert doc and len(doc.strip()) > 10, name
    assert "ConfigError" in zinc.initialize.__doc__ and "on_step" in zinc.train.__doc__
