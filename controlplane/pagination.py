"""Pagination of every API list: `?page=N&page_size=M` (at most 1,000 a page)."""

from rest_framework.pagination import PageNumberPagination


class Pagination(PageNumberPagination):
    page_size_query_param = "page_size"
    max_page_size = 1000
