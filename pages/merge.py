import streamlit as st

st.title("merge")
st.info("This page is not built yet.")
