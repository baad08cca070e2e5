from .threadsafe_ast import install as _serialize_ast_parse

_serialize_ast_parse()  # every process of the product imports this package; see threadsafe_ast
