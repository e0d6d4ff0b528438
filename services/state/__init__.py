"""Everything iserve keeps in Redis: key names (``keys``), record encoding
(``records``) and the store with its atomic capacity operations (``store``)."""
