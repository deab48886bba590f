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
        if isinstance(node, ast.ImportFrom):
            top.update(a.asname or a.name for a in node.names)
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
    assert "in place" in zinc.optim.AdamW.__doc__ and "bf16_out" in zinc.optim.AdamW.step.__doc__


def test_optim_stub_covers_adamw():
    tree = ast.parse(STUB.with_name("optim.pyi").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AdamW"]
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    names |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    public = {n for n in dir(zinc.optim.AdamW) if not n.startswith("_")}
    assert public <= names, public - names
