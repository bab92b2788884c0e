//! Fetching http(s) images in the filter: which URLs may be fetched ([`guard`]).
pub mod guard;
