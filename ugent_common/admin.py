"""What every room's admin shares: records shown, never edited, and buttons that post to an action; and the
change lists of the tables that grow with the traffic, whose page load costs the same at any size."""
from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.utils import get_last_value_from_parameters
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.utils.functional import cached_property


class BoundedCountPaginator(Paginator):
    """A paginator whose count reads at most the rows of the pages up to `ahead` past the one shown.

    Django's paginator counts the whole (filtered) table on every page load: COUNT(*) over millions of events
    is a walk of all of them. This one counts `SELECT COUNT(*) FROM (… ORDER BY <the list's order> LIMIT n+1)`,
    n being the rows of the shown page and the `ahead` pages after it (1,000 rows on the first page at 100 a
    page): the same walk as showing those pages, in the list's own order, so it stops as early as the page read
    does. A smaller result is counted exactly; a larger one is shown as "more than n", with links to the pages
    that reach it and one past it, and counted further as the operator pages on (each page's OFFSET costs what
    its position does: that is the page read's own cost, not the count's)."""

    ahead = 10  # pages counted past the one shown

    def __init__(self, object_list, per_page, orphans=0, allow_empty_first_page=True, *, page_number=1):
        super().__init__(object_list, per_page, orphans, allow_empty_first_page)
        self.reach = (max(1, page_number) - 1 + self.ahead) * self.per_page
        self.count_capped = False

    @cached_property
    def count(self):
        counted = self.object_list[:self.reach + 1].count()
        self.count_capped = counted > self.reach
        return counted


class ValuesFilter(admin.AllValuesFieldListFilter):
    """A text field's filter whose choices cost no scan of the table. Django's own
    (AllValuesFieldListFilter) runs SELECT DISTINCT over every row on every page load; this one offers the
    values the code knows (`known`, a tuple or a callable returning values), those of the newest `sample`
    rows (a bounded read in id order: a value the code does not list still shows while it is in use), and
    the one chosen. The parameters are Django's (?field=value), so any value typed into the URL filters too."""

    known: tuple | object = ()
    sample = 1000

    def __init__(self, field, request, params, model, model_admin, field_path):
        # AllValuesFieldListFilter.__init__ would read every distinct value: its attributes are set here instead
        self.lookup_kwarg = field_path
        self.lookup_kwarg_isnull = f"{field_path}__isnull"
        self.lookup_val = params.get(self.lookup_kwarg)
        self.lookup_val_isnull = get_last_value_from_parameters(params, self.lookup_kwarg_isnull)
        self.empty_value_display = model_admin.get_empty_value_display()
        known = self.known() if callable(self.known) else self.known
        newest = model._default_manager.order_by("-pk").values_list(field.name, flat=True)[:self.sample]
        values = {*known, *newest, *(self.lookup_val or ())}
        self.lookup_choices = sorted(v for v in values if v is not None)
        admin.FieldListFilter.__init__(self, field, request, params, model, model_admin, field_path)


def values_filter(known=(), *, sample: int = ValuesFilter.sample) -> type[ValuesFilter]:
    """A ValuesFilter offering `known` (values, or a callable that returns them) for list_filter:
    ("type", values_filter(EVENT_TYPES))."""
    return type("ValuesFilter", (ValuesFilter,),
                {"known": staticmethod(known) if callable(known) else tuple(known), "sample": sample})


#: The furthest page a bounded list counts to (a larger ?p= is no page: its LIMIT would overflow the database's).
MAX_PAGE = 10 ** 6


class BoundedChangeList(ChangeList):
    """Django's change list, sorting only by the columns its admin's `sortable_by` names: a column's header
    offers no other, and ?o= naming one is ignored (Django sorts by it anyway, whatever the index)."""

    def get_ordering_field(self, field_name):
        if self.sortable_by is not None and field_name not in self.sortable_by:
            return None
        return super().get_ordering_field(field_name)


class BoundedListAdmin(admin.ModelAdmin):
    """The change list of a table that grows with the traffic (events, messages, turns, deliveries, runs…):
    each page load reads a bounded number of rows, whatever the table holds.

    * the count is BoundedCountPaginator's, and there is no second count of the unfiltered table
      (show_full_result_count) nor per-choice counts of each filter (facets);
    * filters are on choices, booleans, small tables or ValuesFilter, never Django's SELECT DISTINCT;
    * no date_hierarchy (its year list is a DISTINCT over every row): a DateFieldListFilter on created_at
      (today, past 7 days, this month, this year: links, no query), read newest first by id;
    * the columns sort only where an index serves the order (`sortable_by`): "created at" sorts by id, which
      is handed out in the same order as created_at is set, so it costs what the default order does.
    A subclass lists its sortable columns; the default is the id and `created`."""

    paginator = BoundedCountPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    sortable_by = ("id", "created")

    def get_paginator(self, request, queryset, per_page, orphans=0, allow_empty_first_page=True):
        try:
            page_number = int(request.GET.get("p", 1))  # (the change list's own page parameter)
        except ValueError:
            page_number = 1
        if not 1 <= page_number <= MAX_PAGE:
            page_number = 1  # the change list finds no such page and says so (?e=1), as Django's own does
        return self.paginator(queryset, per_page, orphans, allow_empty_first_page, page_number=page_number)

    def get_changelist(self, request, **kwargs):
        return BoundedChangeList

    @admin.display(description="created at", ordering="id")
    def created(self, obj):
        return obj.created_at


class RecordAdmin(BoundedListAdmin):
    """A record (a turn, a receipt, a message, an event): readable in the admin, never added, edited or
    deleted there. What an operator may do to one is an action that calls a service."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def may_act(self, request) -> bool:
        """An operator action needs the model's change permission, which the record itself never grants."""
        opts = self.model._meta
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")
